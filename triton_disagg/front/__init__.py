"""The front end's process: preprocess, orchestrator, transports, token inbox, detokenize."""
