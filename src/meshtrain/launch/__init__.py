"""``meshtrain train``: checks, then torchrun's engine starts the ranks (:mod:`meshtrain.cli.train`)."""
