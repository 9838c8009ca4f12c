"""The llama.cpp backend (llama-cpp-python): backend.py says what it holds and loads a session (session.py);
the rest are its parts — batch and serving, context shift, speculation, the prompt cache, the build guard.
"""
