"""What a user would write instead of addnorm for text: FastAPI calling sentence-transformers, OpenAI's
``/v1/embeddings`` shape. ``python -m bench.st_app --model DIR --port P`` (``bench.text`` starts it):

- as its docs suggest for blocking work, one ``model.encode`` per request in FastAPI's thread pool, on torch;
- ``--backend onnx --batch``: the same app at its CPU best: sentence-transformers' ONNX backend (onnxruntime, through
  optimum) and a micro-batcher: one encoding at a time, of every request that queued while the last one ran (up to
  ``--max-batch`` sentences, which ``encode`` sorts by length into batches of 32). Its ONNX backend needs optimum,
  whose pins (transformers < 4.58) the dev environment cannot take: it runs in the peers' environment
  (``make peers``, beside Infinity).

With ``--cross-encoder``, TEI's ``/rerank`` shape on ``CrossEncoder.predict`` instead (``bench.rerank``)."""

from __future__ import annotations

import asyncio

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


def create(model_dir: str, backend: str = "torch", batch: bool = False, max_batch: int = 256) -> FastAPI:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu", backend=backend, local_files_only=True)
    app = FastAPI()
    encode = Batcher(model, max_batch).encode if batch else None

    @app.get("/health/ready")
    def ready() -> dict:
        return {"ready": True}

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest) -> dict:
        texts = [req.input] if isinstance(req.input, str) else req.input
        if encode is not None:
            vectors = await encode(texts)
        else:
            vectors = await run_in_threadpool(model.encode, texts, batch_size=32)
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)
            ],
            "model": req.model or "st",
        }

    return app


class Batcher:
    """One ``model.encode`` at a time, in a thread, of every request queued while the last ran (up to
    ``max_batch`` sentences): the dynamic batching a user adds to a plain app."""

    def __init__(self, model, max_batch: int) -> None:
        self.model, self.max_batch = model, max_batch
        self.queue: asyncio.Queue | None = None

    async def encode(self, texts: list[str]) -> list:
        if self.queue is None:  # made on the server's loop, with its one worker
            self.queue = asyncio.Queue()
            asyncio.get_running_loop().create_task(self._work())
        done = asyncio.get_running_loop().create_future()
        await self.queue.put((texts, done))
        return await done

    async def _work(self) -> None:
        while True:
            items = [await self.queue.get()]
            count = len(items[0][0])
            while not self.queue.empty() and count < self.max_batch:
                items.append(self.queue.get_nowait())
                count += len(items[-1][0])
            texts = [t for group, _ in items for t in group]
            try:
                # encode sorts them by length and runs batches of 32: no batch pads a short sentence to the
                # longest of 256
                vectors = await asyncio.to_thread(self.model.encode, texts, batch_size=32)
            except Exception as exc:  # every waiting request gets the error, and the worker goes on
                for _, done in items:
                    if not done.done():  # (a client that left cancelled its own)
                        done.set_exception(exc)
                continue
            start = 0
            for group, done in items:
                if not done.done():
                    done.set_result(vectors[start : start + len(group)])
                start += len(group)


def main() -> None:
    p = Parser(prog="python -m bench.st_app")
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--cross-encoder", action="store_true", help="serve /rerank with CrossEncoder.predict")
    p.add_argument(
        "--backend", choices=["torch", "onnx"], default="torch", help="sentence-transformers' backend"
    )
    p.add_argument("--batch", action="store_true", help="merge queued requests into one encode")
    p.add_argument("--max-batch", type=int, default=256, help="most sentences one merged encode takes")
    args = p.parse_args()
    if args.cross_encoder:
        app = create_reranker(args.model)
    else:
        app = create(args.model, args.backend, args.batch, args.max_batch)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
