"""The quality tasks of ``localctx eval``, shared by every backend's evaluate.py."""
