"""This machine: hardware detection (and named profiles), and what the planner needs from it and the
backends."""
