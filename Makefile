# The course's commands. `make help` lists them.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
N_DEVICES ?= 8
PLATFORM ?= auto
PROFILE ?= auto
BUILD ?= build
PYTEST_ARGS ?=
JUPYTER_DIR ?= notebooks

.PHONY: help setup lab course scaling site test matrix jupyter student bench reference clean-venv

help:
	@echo "make lab       set up, then run the capstone lab (08_lab) into a new folder under $(BUILD)/"
	@echo "               (N_DEVICES=8 PLATFORM=auto|cpu|gpu PROFILE=auto|cpu|gpu|tiny)"
	@echo "make course    run every notebook in order into a new folder under $(BUILD)/course, with a time table"
	@echo "make scaling   run the lab at 1, 2, 4, 8 devices (COUNTS=...) and draw the scaling study"
	@echo "make test      set up, then lint (ruff) and run the whole test suite (what CI runs)"
	@echo "make matrix    every notebook under papermill at MATRIX='1 2 4' devices, results compared across"
	@echo "               them and 8 (part of make test; MATRIX=3 checks the odd-count promise)"
	@echo "make jupyter   set up, then open JupyterLab on notebooks/ (localhost only, token auth);"
	@echo "               JUPYTER_DIR=build/student opens the student notebooks (after make student)"
	@echo "make student   write the student notebooks (solutions removed) to $(BUILD)/student and a zip to hand out"
	@echo "               (ONLY='00 08' runs a subset; PROFILE applies to the lab)"
	@echo "make site      the course run COURSE=$(BUILD)/course as a book (Sphinx) in a new folder $(BUILD)/site[-k];"
	@echo "               STUDENT=1: the student version (no solutions, no outputs) in $(BUILD)/site-student[-k]"
	@echo "make bench     print the strategies' step-time ratios and memory on this machine"

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	@$(PYTHON) tools/check_python.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	@$(PY) -c "import jax, course_lib; print('jax', jax.__version__, '- course_lib ready')"
	@touch $@

lab: setup
	$(PY) -m course_tools.run lab --n-devices $(N_DEVICES) --platform $(PLATFORM) --profile $(PROFILE) --build $(BUILD)

course: setup
	$(PY) -m course_tools.run course --n-devices $(N_DEVICES) --platform $(PLATFORM) --profile $(PROFILE) --build $(BUILD) $(if $(ONLY),--only $(ONLY),)

COUNTS ?= 1 2 4 8
scaling: setup
	$(PY) -m course_tools.run scaling --counts $(COUNTS) --platform $(PLATFORM) --profile $(PROFILE) --build $(BUILD)

COURSE ?= $(BUILD)/course
site: setup
	$(PY) -m course_tools.site $(if $(STUDENT),--student notebooks $(BUILD)/site-student,$(COURSE) $(BUILD)/site)

reference: setup
	$(PY) tools/make_reference.py

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest $(PYTEST_ARGS)

MATRIX ?= 1 2 4
matrix: setup
	COURSE_MATRIX_COUNTS="$(MATRIX)" $(PY) -m pytest tests/test_invariance.py $(PYTEST_ARGS)

jupyter: setup
	$(PY) -m jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.open_browser=False --ServerApp.root_dir=$(JUPYTER_DIR) $(if $(filter 0,$(shell id -u)),--allow-root,)

student: setup
	$(PY) -m course_tools.student notebooks $(BUILD)/student --zip $(BUILD)/jax-course-student.zip

bench: setup
	$(PY) tools/bench_strategies.py

clean-venv:
	rm -rf $(VENV)
