"""OpenAI-compatible HTTP frontend (FastAPI + uvicorn) over `AsyncEngineClient`."""
