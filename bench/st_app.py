"""What a user would write instead of addnorm for text: FastAPI calling sentence-transformers, OpenAI's
``/v1/embeddings`` shape, one ``model.encode`` per request in FastAPI's thread pool (as its docs suggest for
blocking work). ``python -m bench.st_app --model DIR --port P`` (``bench.text`` starts it)."""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel

from addnorm.commands import Parser


class EmbeddingRequest(BaseModel):
    input: str | list[str]
    model: str | None = None


def create(model_dir: str) -> FastAPI:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    app = FastAPI()

    @app.get("/health/ready")
    def ready() -> dict:
        return {"ready": True}

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest) -> dict:
        texts = [req.input] if isinstance(req.input, str) else req.input
        vectors = await run_in_threadpool(model.encode, texts, batch_size=32)
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)
            ],
            "model": req.model or "st",
        }

    return app


def main() -> None:
    p = Parser(prog="python -m bench.st_app")
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    uvicorn.run(create(args.model), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
