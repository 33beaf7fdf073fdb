"""rollflow environments: both styles, the tool-call protocol, the episode runner."""
