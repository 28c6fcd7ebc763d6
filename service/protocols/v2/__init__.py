"""/v2: the Open Inference Protocol over HTTP, with the binary tensor data extension."""
