"""The `kvchat` command line: serve, fleet, db, keys, admin, generate,
init-model, memory."""


def main() -> None:
    from kvchat.app.cli.main import main as run

    run()
