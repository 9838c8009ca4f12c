"""Model files, backend-neutral: references (path, folder, hub id), the GGUF header and its cache, the
ModelSpec reader, and chat templates."""
