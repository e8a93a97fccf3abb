"""judge/: AutoJudge: tasks with checkers, the OS-level sandbox for model-written code, mining, the classifier, and the acceptance policy it hands to spec/."""
