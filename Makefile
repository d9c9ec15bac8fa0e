.DEFAULT_GOAL := help
VENV := .venv/bin

help: ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

develop: ## build (release) and install into .venv
	bash scripts/setup_env.sh

test: ## every test (Rust then Python), as CI runs them
	bash scripts/test.sh

test-fast: ## Rust and the Python tests that need no .venv-sglang (a few minutes; after make develop)
	if cargo nextest --version >/dev/null 2>&1; then cargo nextest run --workspace --exclude histospec-py; \
	else cargo test --workspace --exclude histospec-py; fi
	$(VENV)/python -m pytest tests -m "not sglang"

bench: ## the index benchmark, JSON in bench/out/index.json
	OPENBLAS_NUM_THREADS=1 $(VENV)/histospec-sgl bench index --json bench/out/index.json

lint: ## rustfmt, clippy, ruff, mypy, and stubtest for the extension's type stubs
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	bash scripts/lint_python.sh

check: lint test ## lint + test

.PHONY: help develop test test-fast bench lint check
