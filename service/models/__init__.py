"""The models a server holds and their lifecycle: ``registry`` (each model's slot, the lookup every request makes,
every state change, the requests in flight), ``state`` (the server's state, loading at start-up and by model
control, verification at load) and ``live_parity`` (answers re-checked while serving)."""
