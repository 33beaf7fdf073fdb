"""The run folder: Parquet records, atomic writes, DuckDB views, MLflow.

- ``records``: the frozen stage records (pinned contract); ``arrow_schemas``: their Arrow
  schemas and optional columns; ``schemas``: the exact conversions between records and
  tables (``nested`` flattens messages and actions).
- ``parquet``: atomic writes, part files, checked reads; ``errors``: what they raise.
- ``runfolder``: one run's layout, progress and resume; ``runs``: status of many runs.
- ``views`` / ``query``: read-only DuckDB views and the metric SQL the pipeline logs;
  ``transcript``: one episode as readable text.
- ``tracking``: the MLflow adapter (the only module importing MLflow).
- ``synthetic``: deterministic records for tests and the benchmark.

The full schema and folder layout are documented in ``docs/storage.md``.
"""
