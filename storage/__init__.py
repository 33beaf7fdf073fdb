"""The run folder: Parquet records, atomic writes, DuckDB views, MLflow."""
