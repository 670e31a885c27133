# The course's commands. `make help` lists them with the options each one takes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
N_DEVICES ?= 8
PLATFORM ?= auto
PROFILE ?= auto
BUILD ?= build
PYTEST_ARGS ?=
JUPYTER_DIR ?= notebooks
COUNTS ?= 1 2 4 8
MATRIX ?= 1 2 4
COURSE ?=
STUDENT ?=
OVERWRITE ?=
LOAD ?= 0
ONLY ?=
SINCE ?= HEAD
# make test's second environment (README, "Two environments"): JAX 0.10.2 on Python 3.11 in .venv311.
# PY311=auto finds a Python 3.11 (tools/check_python.py --find-3.11), PY311=/path/to/python3.11 names one,
# PY311=0 skips it.
PY311 ?= auto
VENV311 := .venv311

# --- the options each target takes -------------------------------------------------------------------
# A variable given on make's command line that none of the named targets reads is refused by name (make
# would otherwise run with the defaults and say nothing). PYTHON and VENV reach every target (each one sets
# up .venv first). tests/test_make.py checks every target's options against README.
OPTIONS_help :=
OPTIONS_setup :=
OPTIONS_lab := N_DEVICES PLATFORM PROFILE BUILD
OPTIONS_course := N_DEVICES PLATFORM PROFILE BUILD ONLY
OPTIONS_scaling := COUNTS PLATFORM PROFILE BUILD
OPTIONS_site := COURSE STUDENT BUILD
OPTIONS_student := BUILD OVERWRITE
OPTIONS_reference := OVERWRITE
OPTIONS_test := PYTEST_ARGS LOAD PY311
OPTIONS_check := SINCE PYTEST_ARGS
OPTIONS_matrix := MATRIX PYTEST_ARGS LOAD
OPTIONS_jupyter := JUPYTER_DIR
OPTIONS_bench := N_DEVICES PLATFORM PROFILE
OPTIONS_clean-venv :=
TARGETS := help setup lab course scaling site student reference test check matrix jupyter bench clean-venv

GOALS := $(or $(MAKECMDGOALS),help)
GIVEN := $(sort $(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v))))
UNKNOWN_GOALS := $(filter-out $(TARGETS),$(GOALS))
ifneq ($(UNKNOWN_GOALS),)
$(error there is no target '$(firstword $(UNKNOWN_GOALS))': the targets are $(TARGETS) (make help says what each does))
endif
ACCEPTED := PYTHON VENV $(foreach g,$(GOALS),$(OPTIONS_$(g)))
REFUSED := $(filter-out $(ACCEPTED),$(GIVEN))
ifneq ($(REFUSED),)
$(error make $(GOALS) takes no $(firstword $(REFUSED)) (given: $(firstword $(REFUSED))=$($(firstword $(REFUSED)))): \
its options are $(or $(sort $(foreach g,$(GOALS),$(OPTIONS_$(g)))),none) besides PYTHON and VENV; make help lists each target's options)
endif
define yes_or_no # $(call yes_or_no,NAME): NAME is empty, 0 or 1
$(if $(filter-out 0 1,$($(1))),$(error $(1)=$($(1)) is not 0 or 1 (e.g. $(1)=1)))
endef
$(call yes_or_no,STUDENT)
$(call yes_or_no,OVERWRITE)
ifneq ($(shell echo '$(LOAD)' | grep -Ex '[0-9]+'),$(LOAD))
$(error LOAD=$(LOAD) is not a number of busy processes (e.g. LOAD=2; 0 runs without them))
endif
YES = $(filter 1,$($(1)))
# The student package (make student's zip) holds no tests/ and no solutions: targets that need them say so.
IN_PACKAGE := $(if $(wildcard tests/conftest.py),,1)
define not_in_package
	@echo "make $@ is not part of the student package (it needs the course's tests/ and solution notebooks):"\
	 "run it in a clone of the course repository" >&2; exit 2
endef
# make test's second environment: the Python 3.11 it is built with (empty: none found, or PY311=0). What
# runs there: the unit tests and every notebook as committed (nbmake), not SLOW311 — the invariance matrix,
# the runner's fault tests, the book, JupyterLab and make itself test the course's tools, not JAX, and are
# the slowest; they run in VENV — nor NOT_YET311.
ifeq ($(filter test,$(GOALS))-$(IN_PACKAGE),test-)  # make test in the repository (the package has no tests)
PY311_PATH := $(if $(filter auto,$(PY311)),$(shell $(PYTHON) tools/check_python.py --find-3.11 2>/dev/null),$(filter-out 0,$(PY311)))
endif
SECOND311 := $(if $(PY311_PATH),$(if $(filter $(abspath $(VENV)),$(abspath $(VENV311))),,yes))
SLOW311 := test_invariance.py test_run.py test_site.py test_jupyterlab.py test_make.py \
  test_checks_devices.py test_lessons.py test_student.py
# (the last three: each passed alone under .venv311 on 2026-12-06 — README, "Tests" — and is left to VENV
# for the suite's time: the answer-shipping runs start a fresh 8-device process per answer, test_lessons and
# test_student run every notebook's student version again)
# Files not yet green under JAX 0.10.2 on Python 3.11, left out of its run: none. Every file outside SLOW311
# was run alone under .venv311 and passes there (README, "Tests"); a file that cannot run there goes here,
# with its reason.
NOT_YET311 :=
# `make test LOAD=2`: the suite with 2 busy processes beside it (tools/cpu_load.py), as on a loaded machine.
UNDER_LOAD = $(if $(filter-out 0,$(LOAD)),$(PY) tools/cpu_load.py --busy $(LOAD) --,)

.PHONY: $(TARGETS)

help:
	@echo "make lab       set up, then run the capstone lab (08_lab) into a new folder $(BUILD)/lab[-k]"
	@echo "               N_DEVICES=8 PLATFORM=auto|cpu|gpu|tpu PROFILE=auto|cpu|gpu|tiny BUILD=build"
	@echo "make course    every notebook in order into a new folder $(BUILD)/course[-k], with a time table"
	@echo "               N_DEVICES PLATFORM PROFILE (the lab's) BUILD, ONLY='00 08' runs a subset"
	@echo "make scaling   the lab (08) and the transformer lab (12) at COUNTS='1 2 4 8' devices, one process"
	@echo "               each, and the scaling study into a new folder $(BUILD)/scaling[-k]; PLATFORM PROFILE BUILD"
	@echo "make site      the newest course run under $(BUILD)/ as a book (Sphinx) in a new folder $(BUILD)/site[-k];"
	@echo "               COURSE=$(BUILD)/course-2 picks a run; STUDENT=1: the student version (no solutions,"
	@echo "               no outputs) in $(BUILD)/site-student[-k]"
	@echo "make jupyter   set up, then open JupyterLab on JUPYTER_DIR=notebooks (localhost only, token auth)"
ifeq ($(IN_PACKAGE),)
	@echo "make student   the student notebooks (solutions removed) in $(BUILD)/student and a zip to hand out,"
	@echo "               $(BUILD)/jax-course-student.zip; OVERWRITE=1 replaces an earlier one"
	@echo "make test      set up, then lint (ruff) and run the whole test suite (what CI runs);"
	@echo "               PYTEST_ARGS='-k lab' passes pytest options; LOAD=2 runs it beside 2 busy processes;"
	@echo "               then the unit tests and every notebook in the second environment, JAX 0.10.2 on"
	@echo "               Python 3.11 (.venv311; PY311=auto finds a 3.11, PY311=/path names one, PY311=0 skips)"
	@echo "make check     the contributor's check (minutes): lint, then the test files and notebooks that the"
	@echo "               files changed since SINCE=HEAD (uncommitted; SINCE=main: the branch) touch, found by"
	@echo "               their imports (tools/affected.py); PYTEST_ARGS. make test before merging"
	@echo "make matrix    every notebook under papermill at MATRIX='1 2 4' devices, results compared across"
	@echo "               them and 8 (part of make test; MATRIX=3 checks the odd-count promise); PYTEST_ARGS LOAD"
	@echo "make reference record data/reference_cpu_8sim*.csv again (OVERWRITE=1 replaces the committed ones)"
endif
	@echo "make bench     the strategies' step-time ratios and memory on this machine (N_DEVICES PLATFORM PROFILE)"
	@echo "Every target also takes PYTHON=python3.12 (the Python that builds .venv) and VENV=.venv;"
	@echo "make setup PYTHON=python3.11 VENV=.venv311 builds the second environment (JAX 0.10.2)."

setup: $(VENV)/.installed

# $(call build_venv,PYTHON,VENV): VENV/ from the requirements file for PYTHON's version (requirements.txt
# on Python >= 3.12, requirements-py311.txt on 3.11; tools/check_python.py says which, and refuses older ones).
define build_venv
	@$(1) tools/check_python.py
	$(1) -m venv $(2)
	$(2)/bin/python -m pip install --quiet --upgrade pip
	$(2)/bin/python -m pip install --quiet -r $$($(1) tools/check_python.py --requirements)
	$(2)/bin/python -m pip install --quiet --no-deps -e .
	@$(2)/bin/python -c "import jax, course_lib; print('jax', jax.__version__, '- course_lib ready')"
	@touch $(2)/.installed
endef

$(VENV)/.installed: requirements.txt requirements-py311.txt pyproject.toml
	$(call build_venv,$(PYTHON),$(VENV))

ifneq ($(SECOND311),)
$(VENV311)/.installed: requirements-py311.txt pyproject.toml
	@test "$$($(PY311_PATH) tools/check_python.py --requirements 2>/dev/null)" = requirements-py311.txt || \
	  { echo "make test PY311=$(PY311): $(PY311_PATH) is not a working Python 3.11 (it builds $(VENV311))" >&2; exit 2; }
	$(call build_venv,$(PY311_PATH),$(VENV311))
endif

lab: setup
	$(PY) -m course_tools.run lab --n-devices $(N_DEVICES) --platform $(PLATFORM) --profile $(PROFILE) --build $(BUILD)

course: setup
	$(PY) -m course_tools.run course --n-devices $(N_DEVICES) --platform $(PLATFORM) --profile $(PROFILE) --build $(BUILD) $(if $(ONLY),--only $(ONLY),)

scaling: setup
	$(PY) -m course_tools.run scaling --counts $(COUNTS) --platform $(PLATFORM) --profile $(PROFILE) --build $(BUILD)

site: setup
ifneq ($(call YES,STUDENT),)
	$(if $(COURSE),$(error make site STUDENT=1 builds the student version from notebooks/, not a course run: drop COURSE=$(COURSE)))
	$(PY) -m course_tools.site --student notebooks $(BUILD)/site-student
else
	$(PY) -m course_tools.site $(or $(COURSE),--newest-in $(BUILD)) $(BUILD)/site
endif

reference: setup
ifeq ($(IN_PACKAGE),)
	$(PY) tools/make_reference.py $(if $(call YES,OVERWRITE),--overwrite,)
else
	$(not_in_package)
endif

test: setup $(if $(SECOND311),$(VENV311)/.installed)
ifeq ($(IN_PACKAGE),)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(UNDER_LOAD) $(PY) -m pytest $(PYTEST_ARGS)
ifneq ($(SECOND311),)
	@echo "make test: the second environment, JAX 0.10.2 on $(PY311_PATH) in $(VENV311)"
	COURSE_NBMAKE_SHELL_FLAGS=1 $(UNDER_LOAD) $(VENV311)/bin/python -m pytest tests notebooks $(addprefix --ignore=tests/,$(SLOW311) $(NOT_YET311))
else ifeq ($(abspath $(VENV)),$(abspath $(VENV311)))
	@echo "make test: this run was in the second environment ($(VENV311)) itself"
else ifeq ($(PY311),0)
	@echo "make test: the second environment (JAX 0.10.2 on Python 3.11) was skipped: PY311=0" >&2
else
	@echo "make test: NO PYTHON 3.11 FOUND, so the second environment (JAX 0.10.2 on Python 3.11) was NOT tested:" \
	  "looked for \$$PYTHON311, pyenv's versions/3.11.*, python3.11 on PATH, /usr/bin/python3.11. Install one" \
	  "(pyenv install 3.11 or apt-get install python3.11-venv) or name it: make test PY311=/path/to/python3.11" >&2
endif
else
	$(not_in_package)
endif

check: setup
ifeq ($(IN_PACKAGE),)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@echo "make check: what the files changed since $(SINCE) touch (tools/affected.py --since $(SINCE)):"
	targets="$$($(PY) tools/affected.py --since $(SINCE) --explain)" && $(PY) -m pytest $$targets $(PYTEST_ARGS)
else
	$(not_in_package)
endif

matrix: setup
ifeq ($(IN_PACKAGE),)
	COURSE_MATRIX_COUNTS="$(MATRIX)" $(UNDER_LOAD) $(PY) -m pytest tests/test_invariance.py $(PYTEST_ARGS)
else
	$(not_in_package)
endif

jupyter: setup
	@$(PY) -m course_tools.student notebooks --check $(JUPYTER_DIR)
	$(PY) -m jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.open_browser=False --ServerApp.root_dir=$(JUPYTER_DIR) \
	  --KernelManager.transport_encryption=auto $(if $(filter 0,$(shell id -u)),--allow-root,)

student: setup
ifeq ($(IN_PACKAGE),)
	$(PY) -m course_tools.student notebooks $(BUILD)/student --zip $(BUILD)/jax-course-student.zip \
	  $(if $(call YES,OVERWRITE),--overwrite,)
else
	$(not_in_package)
endif

bench: setup
	$(PY) tools/bench_strategies.py --n-devices $(N_DEVICES) --platform $(PLATFORM) --profile $(PROFILE)

clean-venv:
	rm -rf $(VENV)
