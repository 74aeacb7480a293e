"""vision-serve's OpenAI-compatible HTTP server (``vision-serve serve``).

``vision_serve.app.create_app(engine, settings)`` builds the FastAPI app around a started
``engine.AsyncEngine``; ``vision_serve.server_cli`` wires flags, environment and uvicorn.
Nothing heavy is imported here, so ``vision-serve --help`` stays fast.
"""
