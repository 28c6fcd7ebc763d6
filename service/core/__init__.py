"""The request core (``inference.run``): what every way in (/v1, V2 over HTTP and gRPC) calls between its codec's
decode and encode: the model resolved once, deadline, cancellation, trace, the model's batcher. Never imports a front
or a protocol."""
