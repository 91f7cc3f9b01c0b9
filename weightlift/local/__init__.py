"""The local loader: a plan of copy runs (:mod:`.plan`) carried out by worker threads
(:mod:`.mover`) for the verb (:mod:`.loader`), with reads ahead of a load (:mod:`.prefetch`).
Never imports the remote half."""
