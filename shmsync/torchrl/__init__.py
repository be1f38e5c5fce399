"""shmsync as TorchRL's guest: the weight-sync scheme, the trainer hooks, the multi-host
collectors, and the one module (``compat``) through which every TorchRL internal is reached.
Importing this package imports no TorchRL module; its modules do."""
