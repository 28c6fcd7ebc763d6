"""What a user would write instead of addnorm for text: FastAPI calling sentence-transformers, OpenAI's
``/v1/embeddings`` shape, one ``model.encode`` per request in FastAPI's thread pool (as its docs suggest for
blocking work). ``python -m bench.st_app --model DIR --port P`` (``bench.text`` starts it); with ``--cross-encoder``,
TEI's ``/rerank`` shape on ``CrossEncoder.predict`` instead (``bench.rerank``)."""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel

from addnorm.commands import Parser


class EmbeddingRequest(BaseModel):
    input: str | list[str]
    model: str | None = None


class RerankRequest(BaseModel):
    query: str
    texts: list[str]
    truncate: bool = False


def create_reranker(model_dir: str) -> FastAPI:
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(model_dir, device="cpu", local_files_only=True)
    app = FastAPI()

    @app.get("/health/ready")
    def ready() -> dict:
        return {"ready": True}

    @app.post("/rerank")
    async def rerank(req: RerankRequest) -> list[dict]:
        scores = await run_in_threadpool(model.predict, [(req.query, t) for t in req.texts], batch_size=32)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        return [{"index": i, "score": float(scores[i])} for i in order]

    return app


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
    p.add_argument("--cross-encoder", action="store_true", help="serve /rerank with CrossEncoder.predict")
    args = p.parse_args()
    app = create_reranker(args.model) if args.cross_encoder else create(args.model)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
