"""bench/: the code of every `bench` subcommand (commands/bench.py's table) and of `bench all` (the suite, its
steps, peers and report), the journal, and the 70B config `bench batch` plans (configs/). Results JSON lives in
bench/results/ (the repository, not the package); checks that fail on a mismatch are tests (tests/, tests/gpu/)."""
