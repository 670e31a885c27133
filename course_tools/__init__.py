"""course_tools: the course toolkit. It runs the course; a learner need not read it.

- ``run``      — papermill runs of the notebooks: the lab, the whole course, a scaling study
- ``results``  — results files (never silently overwritten) and the references in ``data/``
- ``study``    — scaling study: aggregates lab runs made at several device counts
- ``site``     — executed notebooks rendered as a static HTML site
- ``student``  — the student version of the notebooks (solutions replaced by stubs) and its zip
- ``launcher`` — starts, watches and stops the local processes of a multi-process run
- ``launcher_cli`` — its command line, ``python -m course_tools.launcher launch -P 2 -D 4`` (``--help``)
- ``checks``   — the exercise checkers, one module per lesson

The lesson library (what the notebooks teach) is :mod:`course_lib`; nothing there imports this package.
"""
