.DEFAULT_GOAL := help
VENV := .venv/bin

help: ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

develop: ## build (release) and install into .venv
	bash scripts/setup_env.sh

test: ## every test (Rust then Python), as CI runs them
	bash scripts/test.sh

bench: ## the index benchmark, JSON in bench/out/index.json
	OPENBLAS_NUM_THREADS=1 $(VENV)/histospec-sgl bench index --json bench/out/index.json

lint: ## rustfmt and clippy
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings

check: lint test ## lint + test

.PHONY: help develop test bench lint check
