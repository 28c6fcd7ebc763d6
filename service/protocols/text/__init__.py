"""The text APIs people already call, on an artifact exported with ``--inputs ids`` (model/text.py): OpenAI's
``POST /v1/embeddings`` (openai.py) and text-embeddings-inference's ``POST /embed`` and ``POST /tokenize``
(tei.py). Each is a JSON reading and writing (``TextCodec``) around the request core's text step
(service/core/text.py); V2's BYTES ``text`` input takes the same step (service/protocols/v2/codec.py)."""
