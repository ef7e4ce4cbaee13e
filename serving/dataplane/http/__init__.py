"""The HTTP side of the data plane: the front door (protocol, lane, body budget), the inference consumer and the
Open Inference Protocol's parsing and rendering.
"""
