"""Fixtures of the attack suite (`make attack`): the dev model, and a summary of how many
requests the schema fuzzing sent per database."""

from __future__ import annotations

from collections import Counter

import pytest

# The dev preset, as the service tests make it (one copy per test session).
from kvchat_testing.attack_servers import REQUESTS_PROPERTY


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Requests sent by the schema fuzzing, per database (user properties travel with the
    reports, so this sums over xdist workers too)."""
    sent: Counter[str] = Counter()
    operations: Counter[str] = Counter()
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "teardown":  # recorded after the examples ran
                continue
            for name, value in getattr(report, "user_properties", ()):
                if name == REQUESTS_PROPERTY:
                    backend, count = value
                    sent[backend] += count
                    operations[backend] += 1
    if sent:
        terminalreporter.write_sep("-", "schemathesis requests per database")
        for backend, count in sorted(sent.items()):
            terminalreporter.write_line(
                f"{backend}: {count} requests over {operations[backend]} operations"
            )
        terminalreporter.write_line(f"total: {sum(sent.values())} requests")
