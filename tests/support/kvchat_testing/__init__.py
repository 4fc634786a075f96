"""Helpers shared by kvchat's test suites: builders of models and tokenizers, engines made
for tests, started servers. On the tests' import path through pytest's `pythonpath`
(tests/support), never through the repository root."""
