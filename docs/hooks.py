"""MkDocs hooks of the documentation site (mkdocs.yml, ``hooks:``).

The package's docstrings cross-reference in Sphinx's roles (``:func:`run_experiment```,
``:class:`ExperimentConfig```, ``:mod:`.npz```), which Markdown renders as the role's name
followed by a code span. The API pages show the code span alone.
"""

import re

_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc|const|py:\w+):(<code>)")


def on_page_content(html, page, config, files):  # noqa: ARG001 (MkDocs' hook signature)
    """The rendered page with every ``:role:`` in front of a code span removed."""
    return _ROLE.sub(r"\1", html)
