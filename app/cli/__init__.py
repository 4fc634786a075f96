"""The `kvchat` command line: serve, db, keys, admin, generate, init-model, memory."""


def main() -> None:
    from app.cli.main import main as run

    run()
