"""`python -m app.cli`."""

from app.cli.main import main

main()
