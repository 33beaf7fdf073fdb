"""Starter environments that ``rollflow env new`` copies (see ``rollflow.envs.scaffold``).

Each folder is a complete, runnable environment package with a test that plays it. They
are real modules (not text templates) so they are imported, type-checked and tested like
the rest of the code; ``rollflow.envs.scaffold`` copies a folder and renames its class.
"""
