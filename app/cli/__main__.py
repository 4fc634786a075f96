"""`python -m kvchat.app.cli`."""

from kvchat.app.cli.main import main

main()
