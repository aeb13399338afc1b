"""The generation role: the decode loop and its token sockets."""
