"""The local loader: a plan of copy runs (:mod:`.plan`) carried out by worker threads
(:mod:`.loader`). Never imports the remote half."""
