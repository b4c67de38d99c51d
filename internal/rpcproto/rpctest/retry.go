package rpctest

import (
	"context"
	"sync"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/pgidem/idem/internal/rpcidem"
)

// RetryCase is how a server answers one request of the client
// interceptors' tests, attempt by attempt, and what the client ends with.
type RetryCase struct {
	Outcomes []*Outcome // of the first attempts, the last one repeated; nil: the reply
	Attempts int        // the attempts the client makes; InProgressForever: until the context ends
	Code     uint32     // the code the call ends with (0: OK)
}

// InProgressForever is the Attempts of a call answered in progress
// (ABORTED with RetryInfo) at every attempt: those answers do not count
// toward MaxAttempts, so the client goes on past them until its context
// would end during a wait, and ends with the last answer. Call it with a
// deadline, and check that it made more than MaxAttempts attempts.
const InProgressForever = -1

// RetryCases are the cases by the request's note, for a client whose
// policy allows maxAttempts attempts: UNAVAILABLE and ABORTED with
// RetryInfo (after its delay) are retried; ABORTED without RetryInfo,
// FAILED_PRECONDITION, INVALID_ARGUMENT and NOT_FOUND are not.
func RetryCases(maxAttempts int) map[string]RetryCase {
	fail := func(code uint32, msg string) *Outcome {
		out := Fail(code, msg)
		return &out
	}
	aborted := Fail(rpcidem.CodeAborted, "a call with this key is in progress",
		&errdetails.RetryInfo{RetryDelay: durationpb.New(time.Millisecond)})
	return map[string]RetryCase{
		"unavailable":         {[]*Outcome{fail(codeUnavailable, "store down"), nil}, 2, 0},
		"aborted":             {[]*Outcome{&aborted, &aborted, nil}, 3, 0},
		"failed-precondition": {[]*Outcome{fail(codeFailedPrecondition, "key reused"), nil}, 1, codeFailedPrecondition},
		"invalid-argument":    {[]*Outcome{fail(codeInvalidArgument, "bad key"), nil}, 1, codeInvalidArgument},
		"not-found":           {[]*Outcome{fail(codeNotFound, "no"), nil}, 1, codeNotFound},
		"aborted-forever":     {[]*Outcome{&aborted}, InProgressForever, rpcidem.CodeAborted},
		"aborted-conflict":    {[]*Outcome{fail(codeAborted, "the transaction was aborted"), nil}, 1, codeAborted},
		"ok":                  {[]*Outcome{nil}, 1, 0},
	}
}

// Scripted is the handler that answers each request with the outcomes of
// the case of its note, attempt after attempt; it calls seen (when not
// nil) with each attempt's context and note first.
func Scripted(cases map[string]RetryCase, seen func(ctx context.Context, note string)) Handler {
	var mu sync.Mutex
	attempts := map[string]int{}
	return func(ctx context.Context, _ Tx, req *dynamicpb.Message) Outcome {
		note := Note(req)
		if seen != nil {
			seen(ctx, note)
		}
		mu.Lock()
		n := attempts[note]
		attempts[note]++
		mu.Unlock()
		outcomes := cases[note].Outcomes
		if out := outcomes[min(n, len(outcomes)-1)]; out != nil {
			return *out
		}
		return Outcome{Reply: Reply(1, note)}
	}
}
