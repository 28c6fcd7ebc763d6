"""HTTP routes, gathered in one place. Inference routes come first: the router tries routes in order."""

from fastapi import APIRouter

from service.routes import health, v1, v2

ROUTERS: tuple[APIRouter, ...] = (v2.router, v1.router, health.router)
