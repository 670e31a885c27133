"""Sphinx configuration of the course book (myst-nb + sphinx-book-theme, as the JAX documentation uses).

The sources are not in this folder: ``python -m course_tools.site`` stages them (the executed notebooks of a
course run, the pages rendered from ``pages/``, the lab's plots) in a temporary folder and runs Sphinx on it
with this folder as the configuration directory. Notebooks are rendered with the outputs they have; they are
never executed here.
"""

import sys

# nbformat (which myst-nb reads the notebooks with) imports jsonschema, and jsonschema compiles the grammars
# of the optional rfc3987-syntax package at import: about 2 s of CPU, for URI formats that notebook
# validation never checks. Marking it absent (jsonschema treats it as not installed) keeps the build fast.
sys.modules.setdefault("rfc3987_syntax", None)

project = "Parallel programming with JAX"
author = "the course authors"
copyright = "the course authors, Apache-2.0"
# ``-t student`` (set by the staging step) builds the student version: exercises without solutions.
html_title = project + (" — student version" if tags.has("student") else "")  # noqa: F821 (Sphinx defines tags)

extensions = ["myst_nb", "sphinx_copybutton"]

# Render what the course run produced; never execute a notebook during the site build.
nb_execution_mode = "off"
nb_merge_streams = True  # one block per cell for consecutive prints, as JupyterLab shows them
nb_ipywidgets_js = {}  # no widget JavaScript from a CDN: the book works offline (progress bars become text)
myst_heading_anchors = 3  # anchors for ## and ### headings, so the page contents can link to them
myst_enable_extensions = ["colon_fence"]

smartquotes = False  # labels and values from the results files appear as written (C' stays C')
master_doc = "index"
exclude_patterns = ["_build", "**.ipynb_checkpoints", ".doctrees"]
templates_path = []
html_static_path = ["_static"]
html_css_files = ["course.css"]
html_favicon = (
    "_static/favicon.svg"  # a served book is asked for one: a missing icon is a 404 in the console
)
html_theme = "sphinx_book_theme"
html_theme_options = {
    "show_toc_level": 2,  # per-page contents: ## and ### headings
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "navigation_with_keys": False,
    "use_download_button": True,  # the executed notebook (.ipynb) behind each page
    "use_fullscreen_button": False,
    "use_repository_button": False,
    "navbar_persistent": [],  # the sidebar has the search field; no second one in a header bar
}
# A fixed default: pydata-sphinx-theme logs a console error on a first visit when it is left empty.
html_context = {"default_mode": "light"}
html_show_sourcelink = True
html_copy_source = True  # the download button serves the notebook from _sources/
# Sphinx's own search (search.html + searchindex.js) works from a file:// folder as well as from a server.
html_search_language = "en"
