"""bench/: every `bench` command's code, the journal, the peers and the standalone scripts; results JSON lives in bench/results/ (the repository, not the package)."""
