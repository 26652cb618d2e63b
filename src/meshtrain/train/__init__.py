"""One training run on this rank: the synchronous loop (:mod:`meshtrain.train.loop`), the parameter-server
run (:mod:`meshtrain.train.async_run`), what both set up and report (:mod:`meshtrain.train.setup`) and the
entry point ``python -m meshtrain.train CONFIG`` (:mod:`meshtrain.train.entry`). Importing this package
imports no torch, so the entry point installs its stop handler before torch loads."""
