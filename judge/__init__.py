"""judge/: the AutoJudge acceptance classifier (a later issue)."""
