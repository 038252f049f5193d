module kruntimes.io/sdk/go

go 1.19
