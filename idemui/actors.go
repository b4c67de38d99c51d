package idemui

import (
	"context"
	"net/http"
	"slices"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/audit"
	store "github.com/pgidem/idem/internal/db"
	"github.com/pgidem/idem/internal/driver/dberr"
)

// actorScan bounds the actors a page of a search by actor prefix passes.
const actorScan = 1000

// readActors reads the actors whose name starts with prefix, after the
// actor after ("" for the first page), passing at most actorScan actors;
// next is where the next page goes on ("" when the walk reached the last
// actor).
func readActors(ctx context.Context, db idem.Beginner, prefix, after string) (actors []string, next string, err error) {
	err = audit.Read(ctx, db, func(ctx context.Context, q audit.Planned) error {
		rows, err := queries.ConsoleActorsByPrefix(ctx, q, store.ConsoleActorsByPrefixParams{
			AfterActor: after, ScanActors: actorScan, Prefix: prefix})
		if dberr.SQLState(err) == "0A000" {
			// Citus: no recursive walk of a distributed table.
			return &problem{Status: http.StatusNotImplemented, Code: "unsupported",
				Message: "This database cannot look actors up by prefix (Citus refuses the walk it takes): give the whole actor."}
		}
		if err != nil {
			return err
		}
		slices.SortFunc(rows, func(a, b store.ConsoleActorsByPrefixRow) int { return int(a.N - b.N) })
		for _, r := range rows {
			if r.Match {
				actors = append(actors, r.Actor)
			}
			if r.N == actorScan {
				next = r.Actor
			}
		}
		return nil
	})
	return actors, next, err
}
