"""The documentation site's scripts (`python -m docs.gen_flags`); the pages are Markdown."""
