"""rollflow flows and the command line."""
