"""Running a whole mesh on one machine (`gaas up`)."""
