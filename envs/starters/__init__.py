"""Starter environments that ``rollflow env new`` copies (see ``envs.scaffold``).

Each folder is a complete, runnable environment package with a test that plays it. They
are real modules (not text templates) so they are imported, type-checked and tested like
the rest of the code; ``envs.scaffold`` copies a folder and renames its class.
"""
