"""HTTP routes, gathered in one place."""

from fastapi import APIRouter

from service.routes import health, v1, v2

router = APIRouter()
router.include_router(health.router)
router.include_router(v1.router)
router.include_router(v2.router)
