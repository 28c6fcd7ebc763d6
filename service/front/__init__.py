"""The HTTP front: the FastAPI app (``app.create_app``: routers, lifespan), its one ASGI middleware
(``middleware.Front``: request context, the guard, the body's deadline) and its JSON error handlers, and the front
proxy's configuration (``proxy``: nginx, for what uvicorn does not guard). Imports the core and the protocols; nothing
below imports it."""
