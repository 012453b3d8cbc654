# Each target creates the environment it needs first, so both work on a fresh clone.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/.installed: setup.py constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch first: a bare `torch` requirement would pull a CUDA build
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -c constraints.txt -e ".[test,demo]"
	touch $@

.PHONY: install demo test
install: $(BIN)/.installed

demo: $(BIN)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/hf-lookaround demo $(DEMO_ARGS)

# two workers, one test file each at a time (files share module fixtures); TEST_WORKERS=0 runs serially
TEST_WORKERS ?= 2
# then the package as a user installs it: the wheel (built from the sdist) in a fresh environment outside the tree,
# every module imported, every command's --help, a tiny pretrain (the editable install above cannot show a missing file)
test: $(BIN)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests study/tests $(TEST_ARGS)
	PY=$(PY) bash tools/check_install.sh

.PHONY: install-check
install-check: $(BIN)/.installed
	PY=$(PY) bash tools/check_install.sh
