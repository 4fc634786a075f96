"""Operations: what operators see and change (memory, sessions, defaults), metrics, rate
limits, log redaction."""
