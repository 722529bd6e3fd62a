"""The launcher's process: ``tandem serve`` and ``tandem cluster`` start tritonserver (and HAProxy) on
tandem's model repository, watch it and stop it. Nothing here runs inside a Triton model."""
