"""The four probe handlers (exec, httpGet, tcpSocket, grpc): one attempt, one verdict."""
