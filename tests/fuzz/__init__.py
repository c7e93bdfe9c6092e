"""Coverage-guided fuzzing (atheris) of the KVC parser, the payload reader and the directory scan."""
