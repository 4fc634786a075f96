"""`python -m kvchat.app.fleet`: write deploy/haproxy.cfg, docker-compose's HAProxy configuration,
from the one template (a test checks the committed file is its rendering)."""

from pathlib import Path

from kvchat.app.fleet.haproxy_config import HAProxyConfig

COMPOSE_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy.cfg"

if __name__ == "__main__":
    COMPOSE_CONFIG.parent.mkdir(exist_ok=True)
    COMPOSE_CONFIG.write_text(HAProxyConfig.compose().render())
    print(f"wrote {COMPOSE_CONFIG}")
